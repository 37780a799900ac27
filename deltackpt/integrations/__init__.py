"""Adapters for training frameworks, each imported only when asked for.

* :mod:`deltackpt.integrations.lightning`: ``DeltackptCallback``, a PyTorch Lightning
  ``Callback`` (``pip install deltackpt[lightning]``).
* :mod:`deltackpt.integrations.huggingface`: ``DeltackptTrainerCallback``, a Hugging Face
  ``TrainerCallback`` (``pip install deltackpt[huggingface]``).
* :mod:`deltackpt.integrations.torchrec`: TorchRec DMP models and fused optimizers, saved and
  restored through the Checkpointer as they are; :mod:`deltackpt.integrations.torchrec_marks`
  marks their tables' rows (``pip install deltackpt[torchrec]``, then
  ``pip install --no-deps torchrec==1.9.2``).

This package imports neither framework; importing an adapter module does.
"""
