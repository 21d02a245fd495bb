"""The MXINT8 weight quantiser and its dequantise-in-matmul lowering.

Registered but empty for now.
"""
