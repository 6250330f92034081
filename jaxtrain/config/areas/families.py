"""Other model families Megatron trains (vision, RETRO, DINO, ICT/biencoder): all rejected."""
from jaxtrain.config.knob import K, REJECTED

_M = "megatron"
_WHY = "jaxtrain trains decoder-only language models"
_VISION = (f"vision pretraining (ViT/Swin/MiT classifiers, inpainting) is another model family; "
           f"{_WHY}")
_RETRO = f"RETRO (retrieval-augmented encoder-decoder) is another model family; {_WHY}"
_DINO = f"DINO self-supervised vision training is another model family; {_WHY}"
_ICT = (f"ICT/biencoder retrievers (BERT-based query and context encoders) are another model "
        f"family; {_WHY}")


def _vision(key, type_, default, meaning, **kw):
    return K(key, type_, default, meaning, _M, REJECTED, _VISION, **kw)


def _retro(key, type_, default, meaning):
    return K(key, type_, default, meaning, _M, REJECTED, _RETRO)


def _dino(key, type_, default, meaning):
    return K(key, type_, default, meaning, _M, REJECTED, _DINO)


def _ict(key, type_, default, meaning):
    return K(key, type_, default, meaning, _M, REJECTED, _ICT)


KNOBS = [
    # Vision pretraining
    _vision("vision_pretraining", "bool", False, "Train a vision backbone instead of a language "
            "model."),
    _vision("vision_pretraining_type", "str", "classify", "Vision objective: classification, "
            "inpainting or DINO.", choices=("classify", "inpaint", "dino")),
    _vision("vision_backbone_type", "str", "vit", "Which vision network to use: vit, mit or swin.",
            choices=("vit", "mit", "swin")),
    _vision("swin_backbone_type", "str", "tiny", "Size variant of the Swin backbone.",
            choices=("tiny", "base", "h3")),
    _vision("num_classes", "int", 1000, "Number of image classes of the classifier head."),
    _vision("img_h", "int", 224, "Input image height in pixels."),
    _vision("img_w", "int", 224, "Input image width in pixels."),
    _vision("num_channels", "int", 3, "Channels per input image."),
    _vision("patch_dim", "int", 16, "Side of the square image patches the ViT embeds, in pixels."),
    _vision("classes_fraction", "float", 1.0, "Share of the image classes used for training."),
    _vision("data_per_class_fraction", "float", 1.0, "Share of each class's images used for "
            "training."),

    # RETRO
    _retro("retro_project_dir", "str", None, "RETRO project directory with the retrieval database "
           "and neighbour indexes."),
    _retro("retro_add_retriever", "bool", False, "Add the retrieval encoder and chunked cross-"
           "attention to the model."),
    _retro("retro_cyclic_train_iters", "int", None, "Training steps of cyclic RETRO training."),
    _retro("retro_encoder_layers", "int", 2, "Layers of the retrieval encoder."),
    _retro("retro_encoder_hidden_dropout", "float", 0.1, "Hidden dropout of the retrieval "
           "encoder."),
    _retro("retro_encoder_attention_dropout", "float", 0.1, "Attention dropout of the retrieval "
           "encoder."),
    _retro("retro_num_neighbors", "int", 2, "Retrieved neighbours per input chunk."),
    _retro("retro_num_retrieved_chunks", "int", 2, "Consecutive chunks taken per retrieved "
           "neighbour."),
    _retro("retro_attention_gate", "float", 1.0, "Gate on the retrieval cross-attention output."),
    _retro("retro_verify_neighbor_count", "bool", True, "Check that every sample has the expected "
           "number of neighbours."),

    # DINO
    _dino("dino_local_img_size", "int", 96, "Side of the local crops in pixels."),
    _dino("dino_local_crops_number", "int", 10, "Local crops per image."),
    _dino("dino_head_hidden_size", "int", 2048, "Hidden width of the projection head."),
    _dino("dino_bottleneck_size", "int", 256, "Bottleneck width of the projection head."),
    _dino("dino_freeze_last_layer", "float", 1.0, "Epochs during which the head's last layer stays "
          "frozen."),
    _dino("dino_norm_last_layer", "bool", False, "Weight-normalise the head's last layer."),
    _dino("dino_warmup_teacher_temp", "float", 0.04, "Teacher softmax temperature at the start of "
          "warm-up."),
    _dino("dino_teacher_temp", "float", 0.07, "Teacher softmax temperature after warm-up."),
    _dino("dino_warmup_teacher_temp_epochs", "int", 30, "How long, in epochs, the DINO teacher "
          "temperature ramps to its final value."),

    # ICT / biencoder / retriever utilities
    _ict("ict_head_size", "int", None, "Width of the ICT block-embedding head."),
    _ict("biencoder_projection_dim", "int", 0, "Projection width after the biencoder towers; 0 "
         "means none."),
    _ict("biencoder_shared_query_context_model", "bool", False, "Use one tower for queries and "
         "contexts."),
    _ict("ict_load", "str", None, "Checkpoint directory of a pretrained ICT model."),
    _ict("bert_load", "str", None, "BERT checkpoint that initialises the biencoder towers."),
    _ict("titles_data_path", "str", None, "Indexed dataset of document titles for ICT."),
    _ict("query_in_block_prob", "float", 0.1, "Probability that the ICT query sentence stays in "
         "its block."),
    _ict("use_one_sent_docs", "bool", False, "Keep documents of a single sentence in ICT data."),
    _ict("evidence_data_path", "str", None, "Passage collection that open-domain QA retrieves "
         "from."),
    _ict("retriever_report_topk_accuracies", "list[int]", [], "Values of k whose top-k retrieval "
         "accuracy is reported."),
    _ict("retriever_score_scaling", "bool", False, "Scale retrieval scores by the inverse square "
         "root of the hidden size."),
    _ict("block_data_path", "str", None, "Block metadata file for retrieval indexing."),
    _ict("embedding_path", "str", None, "Where block embeddings computed ahead of time are "
         "stored."),
    _ict("indexer_batch_size", "int", 128, "Batch size while embedding blocks for the index."),
    _ict("indexer_log_interval", "int", 1000, "Batches between progress lines of the indexer."),
]
