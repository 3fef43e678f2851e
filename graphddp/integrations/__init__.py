"""Integrations: code nobody here wrote that builds or reads PyTorch's DDP — frameworks (``install()``) and
checkpoints (``get_model_state_dict``). Sits above ``graphddp.ddp`` (docs/architecture.md).
"""
