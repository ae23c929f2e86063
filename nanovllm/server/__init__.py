"""The OpenAI-compatible HTTP server (FastAPI app, protocol models, metrics); `nanovllm serve` runs it.

Nothing here is imported by ``import nanovllm``: FastAPI, uvicorn and prometheus-client are optional
(``pip install nanovllm[serve]``) and imported only by the server's own modules.
"""
