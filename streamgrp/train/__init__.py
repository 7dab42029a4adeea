"""What a trainer process imports (torch allowed): the trainer client, tensor building, advantages
and the policy loss, the safetensors batch layout, weights by version.
"""
