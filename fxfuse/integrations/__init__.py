"""fxfuse in trainers' loops: `fxfuse.integrations.lightning.FxfuseCallback` (PyTorch Lightning) and
`fxfuse.integrations.transformers.FxfuseCallback` (the Hugging Face `Trainer`); timm's train.py needs
one call (docs/integrations.md).

Each module imports its trainer library when it is itself imported, so `import fxfuse` never does:
fxfuse depends on torch and tabulate only.
"""
