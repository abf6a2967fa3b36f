"""Integrations with the frameworks people train in: Hugging Face `Trainer` (`hf`) and Lightning
(`lightning`); Accelerate works with the plain-loop `Guard` as it is."""
