"""Speculative decoding: propose several next tokens cheaply, verify them in one step of the target model."""
