"""Token choice on the device: request parameters, the sorting sampler (the reference), fused Triton
samplers, and log probabilities; all in float32."""
