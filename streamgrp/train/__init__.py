"""What a trainer process imports (torch allowed): the trainer client, tensor building, advantages
and the policy loss, the safetensors batch layout, weights by version; and the ways into other
trainers: torchrun's conventions (`distributed`), a DataLoader-ready dataset (`dataset`) and TRL's
async GRPO trainer (`trl_async`, needs the ``[trl]`` extra).
"""
