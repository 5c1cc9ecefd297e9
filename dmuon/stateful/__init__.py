"""The stateful layer: storage on the model, hooks, executors, the optimizer object."""
