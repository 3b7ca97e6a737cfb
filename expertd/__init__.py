"""expertd: FP8 MoE weights dequantized once per host, served to workers from shared memory.

This package holds what the server and the client share: the error types, the tensor-index
format, the wire protocol and the low-precision number formats. The stages live in `expertd.server`,
`expertd.client` and `expertd.kernels`.
"""

__version__ = "0.1.0"
