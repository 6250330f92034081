"""Training data: sources, splits, sequence length, packing, loader workers and masks."""
from jaxtrain.config.knob import HONORED, INERT, MAPPED, REJECTED, Alias, K

_BERT = ("BERT/ICT-style data generation (another model family); jaxtrain trains decoder-only "
         "language models on contiguous token sequences")
_MSFT = ("palingenesis documents MSFT as not wired into training: it logs a warning and keeps "
         "source weights fixed; jaxtrain does the same")

_DATALOADER_TYPES = ("single", "cyclic", "external")
_EXTERNAL = ("external hands batching to iterators that a Python training script's dataset "
             "provider returns; jaxtrain is driven by its config alone: write the data as "
             "indexed files (data_path) or .jsonl/.parquet files, and pick single or cyclic")
_DATASET_TYPES = ("synthetic", "hf", "grain", "tfds", "c4_mlperf", "olmo_grain")
_NEEDS_TF = ("needs TensorFlow and tensorflow_datasets, which jaxtrain does not depend on: "
             "export the data once to ArrayRecord or Parquet files and use dataset_type: grain "
             "(grain_train_files, grain_file_type), or to .jsonl/.parquet with dataset_type: hf")
_GRAIN_FILE_TYPES = ("arrayrecord", "parquet", "tfrecord")
_GRAIN_PACKING = ("first_fit", "best_fit", "concat_then_split")
_IN_MEMORY = ("jaxtrain reads the grain files whole at start-up, tokenises and packs them in host "
              "memory and serves batches from there (as for hf files); there is no streaming "
              "reader whose buffers or threads this would size")
_GRAIN_WORKERS = ("the samples of this set are read by that many threads of the host process "
                  "(jaxtrain's loader threads; 0 reads in the loop itself) instead of num_workers; "
                  "-1 (auto-tune) keeps num_workers")
_MIX_EPOCH = ("total", "first_exhausted")
_CURRICULUM = ("palingenesis declares the sequence-length curriculum and checks it against "
               "pretokenize, but its data pipeline never builds one (SeqLenCurriculum is not "
               "constructed at 2d07903): its runs train at data.max_seq_length throughout, and "
               "so do jaxtrain's")
_TURN_SCALING = ("uniform", "progressive", "last_heavy")

KNOBS = [
    # Megatron: where the token data comes from and how it is split
    K("data_path", "list[str]|str", None, "Megatron indexed-dataset prefixes to train on, optionally "
      "interleaved with blend weights; split by `split`.", "megatron", status=HONORED),
    K("split", "str", None, "Comma-separated train/valid/test proportions applied to data_path "
      "(e.g. '969,30,1').", "megatron", status=HONORED),
    K("train_data_path", "list[str]|str", None, "Dataset prefixes (with optional weights) used only "
      "for training, instead of data_path plus split.", "megatron", status=HONORED),
    K("valid_data_path", "list[str]|str", None, "Dataset prefixes (with optional weights) used only "
      "for validation.", "megatron", status=HONORED),
    K("test_data_path", "list[str]|str", None, "Dataset prefixes (with optional weights) used only "
      "for the test pass.", "megatron", status=HONORED),
    K("data_args_path", "str", None, "File holding the data_path blend, for blends too long to "
      "write inline.", "megatron", status=HONORED),
    K("per_split_data_args_path", "str", None, "JSON file with train/valid/test keys giving each "
      "split's blend, in place of the *_data_path knobs.", "megatron", status=HONORED),
    K("data_cache_path", "str", None, "Directory where the built sample/shuffle index files are "
      "cached and reused across runs.", "megatron", status=HONORED),
    K("mock_data", "bool", False, "Train on generated random tokens instead of reading any "
      "dataset files.", "megatron", HONORED),
    K("merge_file", "str", None, "BPE merges file of a GPT-2 style tokenizer, used with vocab_file "
      "(the doc's 'blended datasets' wording is wrong).", "megatron", status=HONORED),
    K("sample_rate", "float", 1.0, "Fraction of the training data to sample; declared by Megatron "
      "but read by no training code.", "megatron", INERT,
      "Megatron parses it but nothing in its training or dataset code reads it, so no value "
      "changes a run; use split or blend weights to subsample"),

    # Sequence length
    K("seq_length", "int", 1024, "Tokens per training sequence.", "megatron",
      aliases=(Alias("data.max_seq_length", "pgs-train",
                     note="pgs packs up to, or truncates at, this many tokens"),
               Alias("max_target_length", "maxtext")),
      doc_defaults={"pgs-train": 8192, "maxtext": 2048}, status=HONORED),
    K("encoder_seq_length", "int", None, "Encoder length of an encoder-decoder model (Megatron "
      "copies seq_length into it for GPT).", "megatron", REJECTED,
      "encoder-decoder (T5/BERT) length; jaxtrain models are decoder-only: set seq_length"),
    K("decoder_seq_length", "int", None, "Decoder length of an encoder-decoder model.", "megatron",
      REJECTED, "encoder-decoder (T5) length; jaxtrain models are decoder-only: set seq_length"),
    K("retriever_seq_length", "int", 256, "Token length of inputs to an ICT/biencoder retriever "
      "model.",
      "megatron", REJECTED, "retriever/biencoder models are another family, not trained here"),

    # BERT-style sample generation
    K("mask_prob", "float", 0.15, "Share of tokens replaced by the mask token in masked-LM data.",
      "megatron", REJECTED, _BERT),
    K("short_seq_prob", "float", 0.1, "Chance of emitting a shortened sample in BERT-style data.",
      "megatron", REJECTED, _BERT),

    # Loader mechanics
    K("dataloader_type", "str", "cyclic", "Sampler: single (one pass in order), cyclic (reshuffled "
      "each epoch) or external (user-supplied iterator).", "megatron", status=HONORED,
      rejected_values={"external": _EXTERNAL}, choices=_DATALOADER_TYPES),
    K("data_sharding", "bool", True, "Cyclic sampler: each data-parallel rank shuffles its own "
      "contiguous bucket; false shuffles globally.", "megatron", MAPPED,
      "each process reads only the rows of every global batch that its devices hold "
      "(the per-process row split of the batch), whichever the value; the order is one "
      "seeded shuffle of the whole dataset (false's), so a global batch holds the same "
      "samples for every data-parallel size and losses do not change with the layout"),
    K("num_workers", "int", 8, "Background worker processes feeding batches on each host.",
      "megatron", MAPPED, "threads of the host process read and assemble samples (numpy over "
      "memory-mapped files needs no worker processes) and read the next batch while the current "
      "one trains; 0 reads in the loop itself", aliases=(Alias("data.num_workers", "pgs-train"),),
      doc_defaults={"pgs-train": 4}),
    K("mmap_bin_files", "bool", True, "Memory-map the .bin token files instead of reading them "
      "into host memory.", "megatron", status=HONORED),
    K("num_dataset_builder_threads", "int", 1, "Threads per host used to build the dataset "
      "sample and shuffle indices.", "megatron", status=HONORED),
    K("create_attention_mask_in_dataloader", "bool", True, "Megatron: ship a dense causal mask "
      "tensor with each batch.", "megatron", INERT,
      "jaxtrain derives causal and document masks inside attention from positions and segment "
      "ids; no mask tensor travels with the batch, so the value changes nothing"),

    # Document boundaries inside a sequence
    K("reset_position_ids", "bool", False, "Restart position ids at each end-of-document token "
      "inside a sequence.", "megatron", status=HONORED),
    K("reset_attention_mask", "bool", False, "Stop tokens attending across end-of-document tokens "
      "inside a sequence.", "megatron", status=HONORED),
    K("eod_mask_loss", "bool", False, "Exclude end-of-document tokens from the loss.", "megatron",
      status=HONORED),

    # MaxText input pipeline
    K("dataset_type", "str", None, "Input pipeline: synthetic, hf (Hugging Face datasets), grain, "
      "tfds, c4_mlperf, olmo_grain, or jaxtrain's bundled text corpus; null: the Megatron data "
      "knobs decide.", "maxtext", HONORED, doc_defaults={"maxtext": "synthetic"},
      choices=_DATASET_TYPES + ("corpus",),
      rejected_values={"tfds": "tfds " + _NEEDS_TF, "c4_mlperf": "c4_mlperf reads C4 through "
                       "tfds and " + _NEEDS_TF}),
    K("hf_path", "str", "allenai/c4", "Dataset read when dataset_type is hf: jaxtrain reads a "
      "local directory or file (hub ids are not downloaded).", "maxtext", status=HONORED),
    K("hf_data_dir", "str", "en", "Sub-directory/configuration of the Hugging Face dataset to "
      "read.", "maxtext", status=HONORED),
    K("hf_train_files", "str", "", "Explicit data files (path or glob) for the Hugging Face "
      "loader; empty uses the dataset's own files.", "maxtext", status=HONORED),
    K("packing", "bool", True, "Concatenate several documents into each sequence, masking "
      "attention between them, instead of padding.", "maxtext", status=HONORED,
      aliases=(Alias("data.packing", "pgs-train"),), doc_defaults={"pgs-train": False}),
    K("train_data_columns", "list[str]|str", ["text"], "The row or record field holding each "
      "training document (text, or token ids without tokenize_train_data); one field.",
      "maxtext", HONORED),
    K("eval_data_columns", "list[str]|str", ["text"], "The row or record field holding each "
      "validation document (hf_eval_*/grain_eval_files); one field.", "maxtext", HONORED),
    K("tokenize_train_data", "bool", True, "Tokenise the training column; false reads it as "
      "token ids already (int lists in jsonl/parquet, int64 features in records).", "maxtext",
      HONORED),
    K("tokenize_eval_data", "bool", True, "tokenize_train_data for the validation files.",
      "maxtext", HONORED),
    K("use_truncation", "bool", True, "hf/grain: cut a document longer than a sample to the "
      "sample's length; false splits it into sample-sized pieces instead.", "maxtext",
      HONORED),
    K("enable_data_shuffling", "bool", True, "hf/grain: serve the training samples in a seeded "
      "shuffled order; false keeps the files' order.", "maxtext", HONORED),
    K("train_split", "str", "train", "hf: the split whose files (named as Hugging Face names "
      "them) are read under hf_path; a folder naming no split is all 'train'.", "maxtext",
      HONORED),
    K("hf_eval_split", "str", "", "hf: the split of hf_path read as the validation set; empty "
      "means none unless hf_eval_files is set.", "maxtext", HONORED),
    K("hf_eval_files", "str", "", "hf: data files (path or glob) of the validation set.",
      "maxtext", HONORED),
    K("hf_name", "str", "", "Named configuration of the Hugging Face dataset to load.",
      "maxtext", INERT, "a local folder of data files has no named configurations (they live "
      "in a Hub dataset's loading script or card); pick files with hf_data_dir, "
      "hf_train_files or train_split"),
    K("expansion_factor_real_data", "float", -1.0, "Let only some hosts read data, each reading "
      "this factor more (0..1: rebuild a larger job's grain iterators).", "maxtext", MAPPED,
      "each process reads exactly the rows of the global batch its devices hold, and the data "
      "iterator's state is the count of samples consumed, so a run resumes on any host count; "
      "the batches are the same for every value"),
    K("colocated_python_data_input", "bool", False, "Run the grain pipeline in Pathways' "
      "colocated Python workers on the TPU hosts.", "maxtext", INERT,
      "a Pathways/TPU feature; jaxtrain's processes each read their own rows on the host "
      "they run on, which gives the same batches"),
    K("eval_per_device_batch_size", "float", 0.0, "Validation batch per device (one micro-step "
      "of it x devices sequences); 0 validates with the training batch.", "maxtext",
      status=HONORED),

    # MaxText grain pipeline (dataset_type: grain): ArrayRecord/Parquet/TFRecord documents
    K("grain_train_files", "str", "", "Glob of the training files for dataset_type grain, or a "
      "weighted mixture 'glob,weight;glob,weight'.", "maxtext", HONORED),
    K("grain_eval_files", "str", "", "Glob (or weighted mixture) of the validation files for "
      "dataset_type grain; empty means no validation set.", "maxtext", HONORED),
    K("grain_train_mixture_config_path", "str", "", "JSON file naming the training sources, "
      "{name: {path, weight}}; used instead of grain_train_files.", "maxtext", HONORED),
    K("grain_file_type", "str", "arrayrecord", "Format of the grain files: arrayrecord, parquet "
      "or tfrecord (records: tf.train.Example protos).", "maxtext", HONORED,
      choices=_GRAIN_FILE_TYPES),
    K("grain_packing_type", "str", "first_fit", "How grain packs documents into sequences: "
      "first_fit, best_fit, or concat_then_split (documents cut at row ends).", "maxtext",
      HONORED, choices=_GRAIN_PACKING),
    K("grain_worker_count", "int", 1, "Worker processes grain reads training data with (-1 "
      "picks a count automatically).", "maxtext", MAPPED, _GRAIN_WORKERS),
    K("grain_worker_count_eval", "int", 1, "Worker processes grain reads validation data with.",
      "maxtext", MAPPED, _GRAIN_WORKERS),
    K("grain_per_worker_buffer_size", "int", 1, "Batches each grain training worker keeps "
      "ready ahead of the step.", "maxtext", INERT, _IN_MEMORY),
    K("grain_per_worker_buffer_size_eval", "int", 1, "Batches each grain validation worker "
      "keeps ready.", "maxtext", INERT, _IN_MEMORY),
    K("grain_num_threads", "int", 16, "Threads per grain worker reading records (parquet: files "
      "read and interleaved at once).", "maxtext", INERT, _IN_MEMORY),
    K("grain_num_threads_eval", "int", 16, "grain_num_threads for the validation data.",
      "maxtext", INERT, _IN_MEMORY),
    K("grain_prefetch_buffer_size", "int", 500, "Records each grain worker reads ahead.",
      "maxtext", INERT, _IN_MEMORY),
    K("grain_prefetch_buffer_size_eval", "int", 500, "grain_prefetch_buffer_size for the "
      "validation data.", "maxtext", INERT, _IN_MEMORY),
    K("grain_ram_budget_mb", "int", 1024, "Host memory budget used when grain picks its worker "
      "count itself (grain_worker_count -1).", "maxtext", INERT, _IN_MEMORY),
    K("grain_data_source_max_workers", "int", 16, "Threads that open the sources of a grain "
      "mixture in parallel.", "maxtext", INERT, _IN_MEMORY),
    K("grain_index_storage_option", "str", None, "Where the ArrayRecord reader keeps record "
      "indices: in_memory or offloaded (null: reader default).", "maxtext", INERT, _IN_MEMORY),
    K("grain_shuffle_buffer_size", "int", 100, "Window of the shuffle grain applies to "
      "sequential formats (parquet, tfrecord).", "maxtext", MAPPED,
      "every format is served in one seeded shuffle of all its packed samples (a global "
      "shuffle, as grain gives ArrayRecord), so no shuffle window is needed"),
    K("grain_use_elastic_iterator", "bool", False, "Use grain's elastic iterator so a run can "
      "resume on a different number of hosts.", "maxtext", MAPPED,
      "jaxtrain's global batches do not depend on the number of hosts and resume from the "
      "count of samples consumed, so every run can resume on another host count; either value "
      "behaves so"),

    # MaxText OLMo numpy pipeline (dataset_type: olmo_grain)
    K("olmo_index_path", "str", "", "dataset_type olmo_grain: JSON index of the OLMo token files "
      "(MaxText's build_olmo_npy_index.py writes it).", "maxtext", HONORED),
    K("olmo_path_remap_from", "str", "", "Prefix of the index's file paths to replace (e.g. a "
      "gs:// bucket)...", "maxtext", HONORED),
    K("olmo_path_remap_to", "str", "", "...and what replaces it (e.g. the local mount of that "
      "bucket).", "maxtext", HONORED),
    K("olmo_apply_ngram_filter", "bool", True, "Drop from the loss every OLMo instance in which "
      "a 1-13 token pattern repeats 32 times or more.", "maxtext", HONORED),

    # pgs: dataset files and validation set
    K("data.dataset", "str", "HuggingFaceH4/ultrachat_200k", "Training data: pgs takes a Hugging "
      "Face id, a .jsonl/.json/.parquet file or a folder; jaxtrain reads local plain-text files "
      "and folders.", "pgs-train", status=HONORED),
    K("data.dataset_split", "str", "train_sft", "Split of data.dataset to train on (the "
      "split-named files of a folder).", "pgs-train", status=HONORED),
    K("data.streaming", "bool", True, "Read the dataset lazily as a stream of shards instead of "
      "materialising it first.", "pgs-train", MAPPED,
      "local files are read and tokenised once at start-up and served by index in a seeded "
      "shuffle, whichever the value; for data larger than host memory write indexed files "
      "with python -m jaxtrain.data.preprocess and set data_path: those are memory-mapped "
      "and read lazily"),
    K("data.seed", "int", None, "Seed of the training-data order (and of grain mixtures), apart "
      "from the model's seed; null: the model's seed orders the data.", "pgs-train",
      status=HONORED, doc_defaults={"pgs-train": 42, "maxtext": 0},
      aliases=(Alias("data_shuffle_seed", "maxtext"),)),
    K("data.eval_dataset", "str", "", "Single validation dataset (same forms as data.dataset); "
      "empty means no validation.", "pgs-train", status=HONORED),
    K("data.eval_split", "str", "test", "Split of data.eval_dataset used for validation (its "
      "split-named files when it is a directory).", "pgs-train", status=HONORED),
    K("data.eval_samples", "int", 200, "Size of the fixed validation subset drawn from the eval "
      "dataset.", "pgs-train", status=HONORED),

    # pgs: chat-SFT shaping (jaxtrain/data/chat.py, jaxtrain/data/sft.py)
    K("data.messages_field", "str", "messages", "Row field holding the chat turns (conversations, "
      "chat, dialogue, turns are tried too).", "pgs-train", status=HONORED),
    K("data.tools_field", "str", "tools", "Name of the column whose tool list is given to the "
      "chat template.", "pgs-train", status=HONORED),
    K("data.include_observations", "bool", False, "Also train on tool/observation turns, so the "
      "model learns to predict tool output.", "pgs-train", status=HONORED),
    K("data.train_on_reasoning", "bool", True, "Keep <think>/reasoning tokens in the loss; false "
      "trains only on the final answer.", "pgs-train", status=HONORED),
    K("data.turn_scaling", "str", "uniform", "Per-assistant-turn loss weights (mean 1): uniform, "
      "progressive (later heavier) or last_heavy.", "pgs-train", choices=_TURN_SCALING, status=HONORED),
    K("data.seq_len_curriculum", "bool", False, "Grow the longest sequence from "
      "data.seq_len_curriculum_min to data.max_seq_length over the ramp.", "pgs-train", INERT,
      _CURRICULUM),
    K("data.seq_len_curriculum_min", "int", 1024, "Longest sequence at the curriculum's start.",
      "pgs-train", INERT, _CURRICULUM),
    K("data.seq_len_curriculum_ramp_steps", "int", 1000, "Steps over which the sequence-length "
      "curriculum reaches data.max_seq_length.", "pgs-train", INERT, _CURRICULUM),
    K("data.last_turn_only", "bool", False, "Mask every assistant turn but the last, in training "
      "and in eval scoring.", "pgs-train", status=HONORED),
    K("data.length_group_buffer", "int", 512, "Without packing: sort this many samples by length "
      "into batch groups to cut padding; 0 disables.", "pgs-train", status=HONORED,
      reason="orders each microbatch step's rows by length groups as pgs does; unpacked chat "
             "batches are cut to the length bucket (128, 256, ... up to seq_length) of their "
             "longest row, so grouping turns saved padding into time, with one compiled step "
             "per bucket"),

    # pgs: multi-source mixing, replay and evaluation sources (jaxtrain/data/sft.py)
    K("data.sources", "list", [], "Several training datasets, each a mapping with dataset, split, "
      "weight, mode, messages_field.", "pgs-train", status=HONORED),
    K("data.mix_epoch", "str", "total", "What one epoch over data.sources means: total rows drawn "
      "by weight, or until the first source runs out.", "pgs-train", choices=_MIX_EPOCH, status=HONORED),
    K("data.eval_sources", "list", [], "Validation sets scored separately and combined into a "
      "weighted composite for best-model tracking.", "pgs-train", status=HONORED),
    K("data.pretrain_replay_dataset", "str", "", "Raw-text dataset mixed into SFT with loss on "
      "every token; empty disables replay.", "pgs-train", status=HONORED),
    K("data.pretrain_replay_weight", "float", 0.1, "Per-example probability of drawing a replay "
      "document instead of an SFT example.", "pgs-train", status=HONORED),

    # pgs: MSFT adaptive source weights (not wired in palingenesis itself)
    K("data.msft_tracking", "bool", False, "Adaptive per-source weight scheduling (MSFT), "
      "documented by pgs as not yet acting on training.", "pgs-train", INERT, _MSFT),
    K("data.msft_eval_every", "int", 50, "MSFT: steps between per-source validation checks.",
      "pgs-train", INERT, _MSFT),
    K("data.msft_decay_factor", "float", 0.7, "MSFT: factor that shrinks an overfitting source's "
      "weight.", "pgs-train", INERT, _MSFT),
    K("data.msft_recovery_factor", "float", 1.15, "MSFT: factor that grows the weight of a source "
      "still improving.", "pgs-train", INERT, _MSFT),
    K("data.msft_floor_ratio", "float", 0.1, "MSFT: lowest weight a source may reach, as a "
      "fraction of its original weight.", "pgs-train", INERT, _MSFT),

    # pgs: pre-tokenised cache (jaxtrain/data/pretokenized.py)
    K("data.pretokenize", "bool", False, "Write the fully tokenised, masked, mixed and packed "
      "stream to disk once and train from that cache.", "pgs-train", status=HONORED),
    K("data.pretokenize_path", "str", "./pretokenized", "Directory of the pre-tokenised cache.",
      "pgs-train", status=HONORED),
]
