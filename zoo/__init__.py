"""AutoFuser's model zoo and benchmark harness (importable as ``autofuser_zoo``).

- ``autofuser_zoo.models.MODELS``: nine neural PDE solvers (transformers and
  neural operators), each in an "airfoil" configuration that follows its paper
  or the standard neural-solver benchmark, and a "tiny" one for CPU tests;
- ``autofuser_zoo.airfoil``: a synthetic airfoil task (potential flow around
  Joukowski airfoils on a structured 221 x 51 O-mesh) and the relative L2 loss;
- ``autofuser_zoo.harness``: ``autofuser bench``, eager vs torch.compile vs
  AutoFuser on the zoo.

See docs/zoo.md.
"""
