"""Image inputs for LLaVA-style models: configs, preprocessing, prompt expansion, prefix-cache keys,
and the encoder step the worker runs. Modules import torch only where they compute."""
