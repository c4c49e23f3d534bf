"""Plug the agent into the trainers people already run.

- ``agent.integrations.hf.MechwatchCallback``: a Hugging Face ``TrainerCallback``
  (``pip install 'mechwatch[hf]'``);
- ``agent.integrations.lightning.MechwatchLightningCallback``: a PyTorch Lightning
  ``Callback`` (``pip install 'mechwatch[lightning]'``).

Each submodule imports its framework; this package imports neither, so the core works without
them.
"""
