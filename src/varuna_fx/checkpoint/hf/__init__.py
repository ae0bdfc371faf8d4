"""Hugging Face weights: safetensors files read and written without running code
(``safetensors_files``), the names transformers uses (``keys``, ``renames``), and
``pipe.load_pretrained`` / ``save_pretrained`` (``pretrained``)."""
