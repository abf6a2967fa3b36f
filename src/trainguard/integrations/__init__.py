"""Integrations with the frameworks people train in: Hugging Face `Trainer` (`hf`), Lightning
(`lightning`) and DeepSpeed engines (`deepspeed`, ZeRO 1-3); Accelerate works with the
plain-loop `Guard` as it is."""
