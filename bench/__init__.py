"""kvroute benchmarks: micro benchmarks, workloads, the simulator and the end-to-end harness."""
