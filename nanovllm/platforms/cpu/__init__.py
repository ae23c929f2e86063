"""The CPU's execution: settings (resolved once into the engine config), linear methods, row scales, the
attention backend and the sampler's greedy argmax."""
