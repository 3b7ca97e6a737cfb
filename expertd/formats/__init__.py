"""The checkpoint formats expertd serves, each one class: its codec and its dequant entry points together.

`codec` says what every format answers; `scaled_fp8` and `mxfp4` are the formats. `expertd.quantization` picks
one from config.json. A format's dequant methods import `expertd.kernels` inside themselves: the client imports the
formats for their names and checks, and never calls those methods.
"""
