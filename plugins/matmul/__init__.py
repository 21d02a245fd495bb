"""Matrix products (linear, matmul, bmm) and their epilogue/prologue strategies.

Registered but empty for now: products run eager until this plugin lowers them.
"""
