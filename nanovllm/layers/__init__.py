"""Model building blocks: parallel linear layers, norms, rotary embedding, embeddings, activation, sampler."""
