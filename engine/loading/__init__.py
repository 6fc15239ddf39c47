"""What a model directory gives: its config, weights (safetensors, GGUF), tokenizer, image processing, generation
defaults, and the facts the front end needs."""
