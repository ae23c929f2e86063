"""Device-specific execution, chosen once when a model loads: platforms/cpu/ holds what only the CPU runs (its
linear methods, the row-scale plan, the settings resolved from the environment). The layers in nanovllm/layers/
have one forward each and call what was chosen for them (a linear layer's ``linear_method``)."""
