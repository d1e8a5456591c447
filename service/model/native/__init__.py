"""kvfence's own CPU kernels: ``kvf.c``, one translation unit whose parts are split by job (a
GEMV per block layout, panels, the tile unit, LoRA, the decoder stack and its attention glue),
built on first use and called through ctypes by :mod:`service.model.native.kernels`."""
