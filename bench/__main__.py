from bench.benchmarks import main

main()
