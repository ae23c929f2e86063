"""Device-specific execution, chosen once when a model loads: platforms/cpu/ holds what only the CPU runs (its
linear methods, the row-scale plan, its attention backend, the sampler's argmax, the settings resolved from the
environment). The layers in nanovllm/layers/ have one forward each and call what was chosen for them (a linear
layer's ``linear_method``, the sampler's ``greedy_tokens``, the attention layer's backend)."""
