"""Where a model's bytes come from when they are not on this machine: the
Hugging Face Hub (``--model hf:...``), read by byte range. Below the cluster
layer: no Ray, no sockets of the project's own."""
