"""kvserve's PyTorch side: data, tokenizer, the Transformer, training and evaluation.

    data_sources.py    where the training text comes from, fetched once and parsed (torch-free)
    data.py            deduplication, deterministic splits, reading them back (torch-free)
    tokenizer.py       byte-level BPE (torch-free)
    spm_tokenizer.py   Marian's SentencePiece tokenizer, for imported bundles (torch-free)
    config.py          the model's shape and presets
    transformer.py     the encoder-decoder and decoder-only Transformer
    marian.py          Hugging Face Marian / OPUS-MT checkpoints -> the encoder-decoder (checks, weight mapping)
    train.py           the training loop, `train(recipe(task))`; its parts:
      train_config.py    TrainConfig and the default RECIPES
      train_state.py     a run between steps: start fresh or --resume, save with the train state
      schedule.py        the learning rate of each step
      batching.py        the batch of each step
      step.py            loss, backward, clipping, AdamW
      weight_average.py  the moving average of the weights
      validation.py      valid-split figures during training
      run_report.py      metrics.json and loss_curve.png
    loss.py            the fused label-smoothed cross entropy
    cpu_memory.py      glibc's malloc settings that keep a CPU step from faulting pages in
    checkpoint.py      saving and loading a trained model
    decode.py          greedy decoding and LM scoring (the reference for export parity)
    evaluate.py        test-split figures of a checkpoint
    scores.py          chrF, BLEU, bits per character (torch-free)
    tiny.py            a tiny checkpoint fitted in seconds (tests, bench/gpu_check without artifacts)

Nothing here knows about ONNX Runtime or serving; export/ turns what this package trains into a bundle.
"""
