"""stageserve: LLM text generation served as three gRPC services (prepare, device, reclaim).

This package holds what the services really share: generated gRPC stubs (``stageserve.v1``),
model file location, tokenizer loading, server bootstrap and the command line. Each service's own
code lives in ``stageserve.prepare``, ``stageserve.device`` and ``stageserve.reclaim``
(``services/`` in the source tree).
"""
