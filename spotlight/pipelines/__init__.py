"""Diffusers pipeline folders (Qwen-Image, FLUX, SD3) as the model: `folder` reads and checks a
folder's JSON, `model` runs its transformer in its VAE's latent space, `text` caches its prompt
embeddings, `export` writes back into diffusers, `tiny` builds tiny
random folders offline (`spotlight make-pipeline`)."""
