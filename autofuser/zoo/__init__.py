"""AutoFuser's model zoo and benchmark harness.

``import autofuser`` does not import it: only ``autofuser bench`` and
``autofuser models`` do, and the tests and benchmarks that use its models.

- ``autofuser.zoo.models.MODELS``: twelve neural PDE solvers (transformers and
  neural operators), each in an "airfoil" configuration that follows its paper
  or the standard neural-solver benchmark, and a "tiny" one for CPU tests;
- ``autofuser.zoo.airfoil``: a synthetic airfoil task (potential flow around
  Joukowski airfoils on a structured 221 x 51 O-mesh) and the relative L2 loss;
- ``autofuser.zoo.harness``: ``autofuser bench``, eager vs torch.compile vs
  AutoFuser on the zoo.
- ``autofuser.zoo.train_bench``: ``autofuser bench --train``, the same for a
  training step (forward, MSE loss, backward, AdamW step).

See docs/zoo.md.
"""
