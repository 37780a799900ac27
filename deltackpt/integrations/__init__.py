"""Adapters for training frameworks, each imported only when asked for.

* :mod:`deltackpt.integrations.lightning`: ``DeltackptCallback``, a PyTorch Lightning
  ``Callback`` (``pip install deltackpt[lightning]``).
* :mod:`deltackpt.integrations.huggingface`: ``DeltackptTrainerCallback``, a Hugging Face
  ``TrainerCallback`` (``pip install deltackpt[huggingface]``).

This package imports neither framework; importing an adapter module does.
"""
