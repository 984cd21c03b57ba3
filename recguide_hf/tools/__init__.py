"""The `recguide` command line and what it runs: benchmarks (closed and open loop), the profiler, prompt sets."""
