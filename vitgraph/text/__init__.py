"""Text side of image–text training: the offline tokenizer (the text tower lives in
vitgraph.models.text)."""
