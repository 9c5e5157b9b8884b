"""Engine: topologies, plans, scheduling policy, simulator, runtime, kernels, tracing."""
