"""Each stage of the pipeline as one function of the files it reads, the file it writes and the settings it runs
under: nothing looked up behind the caller's back, so a stage can be run, re-run or tested without Luigi. A job
writes its output atomically and returns the one line the log prints for it. The rules it applies live in the
library package, `retool/`; when each job runs is `pipeline/`'s to say."""
