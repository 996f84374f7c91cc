"""One module per backend. Each has ``load() -> Backend`` and ``activate(backend, config, patches, forced)``
(``forced``: chosen by DITORCH_BACKEND rather than detected).

``activate`` uses the vendor's own CUDA-to-device transfer where one exists, then ditorch's
patches for the gaps; PrivateUse1 backends without one get ditorch's generic transfer.
"""
