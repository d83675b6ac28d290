"""kvserve's PyTorch side: data, tokenizer, the Transformer, training and evaluation.

Nothing here knows about ONNX Runtime or serving; export/ turns what this package trains into a bundle.
"""
