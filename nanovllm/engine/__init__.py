"""The engine: requests (Sequence), KV blocks, the scheduler, the model runner and the step loop."""
