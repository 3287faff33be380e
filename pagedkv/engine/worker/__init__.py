"""The workers: executors (a rank's tier I/O too), model runner, step inputs, CUDA graphs."""
