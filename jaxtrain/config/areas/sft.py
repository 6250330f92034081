"""pgs SFT extras: stability and fine-tuning options of train.* and the token-weighting plugins."""
from jaxtrain.config.knob import HONORED, K

_PGS = "pgs-train"
_MERGE_METHODS = ("lerp", "slerp")
_PRE_RL = ("pgs's loss (entropy > 2 or KL > 0.5 nats: not imitated) against the base model: the "
           "weights model.name_or_path names, held frozen beside the train state; pgs's own "
           "trainer compares with logits it cached from an earlier step's batch. Computed chunk "
           "by chunk like the cross-entropy, so the full logits never exist")
_ADAGC = ("one tensor is one stacked copy (each layer's, each expert's); the warm-up is the LR "
          "warm-up, clipped globally to train.max_grad_norm (0: not clipped, where pgs would zero "
          "the gradients); runs once per optimizer step, on the accumulated gradient")
_ADAMC = ("weight decay times lr(t) / peak lr on every decayed leaf, the correction pgs states; "
          "pgs's own code takes the peak after the warm-up's first factor (0), so there the decay "
          "never changes when warmup_ratio > 0")
_LLRD = ("the factor scales each leaf's whole update (decay included; pgs's layer groups also "
         "decay the embeddings), along the stacked layer axis; pgs's muon, 8-bit optimizers and "
         "schedule_free ignore it, so with them it is refused")
_HYPERBALL = ("pgs's angular-step Hyperball over the base optimizer's step taken without weight "
              "decay; one matrix per stacked copy (experts included, which pgs leaves "
              "unconstrained when transformers fuses them into 3-D tensors)")
_MONA = ("on the >= 2-D weights, once per optimizer step on the accumulated gradient (pgs runs it "
         "after every micro-batch, on the running sum): the same with gradient accumulation 1")

KNOBS = [
    # AdaGC: per-tensor adaptive gradient clipping (replaces global clipping)
    K("train.adagc", "bool", False, "Clip each gradient tensor against an EMA of its own norm "
      "instead of clipping the global norm.", _PGS, HONORED, _ADAGC),
    K("train.adagc_lambda", "float", 1.5, "AdaGC threshold: a tensor is clipped when its norm "
      "exceeds this multiple of its norm EMA.", _PGS, HONORED),
    K("train.adagc_beta", "float", 0.95, "AdaGC: smoothing factor of the running per-tensor "
      "gradient-norm average.", _PGS, HONORED),

    # EMA of the weights (an fp32 shadow copy kept in host memory)
    K("train.ema", "bool", False, "Keep an exponential moving average of the weights in host "
      "memory.", _PGS, HONORED, "An fp32 shadow of the trained weights in host memory "
      "(pinned_host, else unpinned_host, else device memory), updated by a jitted function "
      "between steps; checkpoints keep it (item ema) and a resume continues it (pgs restarts "
      "it); the final export (train.save_final) writes it"),
    K("train.ema_decay", "float", 0.999, "EMA decay cap; the effective decay ramps as "
      "min(decay, 1 - 1/(t+1)).", _PGS, HONORED, "t counts the EMA updates so far, this one "
      "included: shadow <- d*shadow + (1-d)*weights in fp32; from 0 to 1"),
    K("train.ema_every", "int", 10, "Optimizer steps between EMA updates.", _PGS, HONORED,
      "Updates at step numbers that are multiples of it; a skipped step (spike, fp16 "
      "overflow) updates nothing, as in pgs"),

    # Periodic merge back toward the pretrained weights (anti-forgetting)
    K("train.base_merge", "bool", False, "Every few steps pull the weights part of the way back "
      "toward the pretrained ones.", _PGS, HONORED, "The base is model.name_or_path's weights "
      "(required), kept in fp16 in host memory (pinned_host, else unpinned_host, else device "
      "memory; plugins.pre_rl's copy when that is on); merged by a jitted function after the "
      "step's evaluation and before its checkpoint (pgs saves first)"),
    K("train.base_merge_ratio", "float", 0.1, "Merge ratio r: weights become (1-r)*current + "
      "r*base.", _PGS, HONORED, "In fp32 with the fp16 base, cast back to each weight's dtype; "
      "from 0 to 1"),
    K("train.base_merge_every", "int", 500, "Optimizer steps between merges toward the base "
      "weights.", _PGS, HONORED, "Merges at step numbers that are multiples of it, skipped "
      "steps counted as in pgs"),
    K("train.base_merge_method", "str", "lerp", "How weights are blended: lerp along a straight "
      "line, or slerp, spherical on matrices so norms hold.", _PGS, HONORED, "slerp: per layer "
      "and expert on weights that are matrices in the checkpoint, lerp when a norm is below "
      "1e-8 or |cos| > 0.9999; vectors (norms, biases) always lerp", choices=_MERGE_METHODS),

    # Optimizer-side extras
    K("train.adamc", "bool", False, "AdamC: scale weight decay with the LR schedule for layers "
      "followed by normalisation.", _PGS, HONORED, _ADAMC),
    K("train.llrd_decay", "float", 1.0, "Layer-wise LR decay d: layer i gets lr*d^(L-i), "
      "embeddings lr*d^(L+1); 1.0 is off.", _PGS, HONORED, _LLRD),
    K("train.freeze_non_attention", "bool", False, "Hybrid models: freeze linear-attention / "
      "recurrent layers except their norms; a warned no-op elsewhere.", _PGS, HONORED,
      "optim/freeze.py: the Gated DeltaNet and Mamba-2 layers get no gradient, optimizer "
      "state or update (norms excepted); on a model without them pgs's warned no-op"),
    K("train.hyperball", "bool", False, "Keep attention/MLP matrices at their initial Frobenius "
      "norm, moving them by an angular step.", _PGS, HONORED, _HYPERBALL),
    K("train.hyperball_lr", "float", 0.0, "Hyperball angular step per update (fraction of the "
      "matrix norm); 0 derives it per matrix.", _PGS, HONORED),
    K("train.mona", "bool", False, "MONA: add an EMA of gradient differences to the gradient "
      "(curvature-aware acceleration).", _PGS, HONORED, _MONA),
    K("train.mona_beta_a", "float", 0.975, "MONA decay of the gradient-difference EMA.", _PGS,
      HONORED),
    K("train.mona_lite", "bool", True, "Keep MONA's buffers in bf16 to cut its memory and time "
      "cost.", _PGS, HONORED),

    # Token-weighting objectives (mutually exclusive)
    K("plugins.deft", "bool", False, "DEFT: weight each token's CE by p_t^alpha, alpha the "
      "squared-probability mass (detached).", _PGS, HONORED),
    K("plugins.dft", "bool", False, "DFT: weight each token's CE by its detached target "
      "probability.", _PGS, HONORED),
    K("plugins.cadft", "bool", False, "CADFT: DFT times a per-sample factor that down-weights "
      "samples with high NLL z-scores.", _PGS, HONORED),
    K("plugins.cadft_beta", "float", 1.0, "CADFT sensitivity beta in exp(-beta*max(0, z)).", _PGS,
      HONORED),
    K("plugins.info_sft", "bool", False, "Weight tokens by their information content (InfoSFT), "
      "rescaled to average 1.", _PGS, HONORED),
    K("plugins.info_sft_pbar", "float", 0.93, "InfoSFT reference probability; tokens above it "
      "get no weight.", _PGS, HONORED),

    # Embedding noise
    K("plugins.sym_noise", "bool", False, "Add symmetric +-1 noise to the input embeddings "
      "during training (regulariser).", _PGS, HONORED),
    K("plugins.sym_noise_alpha", "float", 5.0, "Embedding noise scale alpha; magnitude is "
      "alpha/sqrt(seq_len*hidden).", _PGS, HONORED),

    # Pre-RL objective
    K("plugins.pre_rl", "bool", False, "Pre-RL: mask high-entropy/high-KL tokens from CE and add "
      "an entropy bonus and KL anchor.", _PGS, HONORED, _PRE_RL),
    K("plugins.pre_rl_entropy_coeff", "float", 0.1, "Pre-RL weight of the entropy bonus.", _PGS,
      HONORED),
    K("plugins.pre_rl_kl_coeff", "float", 0.5, "Pre-RL weight of the KL penalty to the base "
      "model.", _PGS, HONORED),
]
