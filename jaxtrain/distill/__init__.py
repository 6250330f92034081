"""On-policy distillation as pgs distill runs it (issue #22). Built so far: the losses and token
weights (:mod:`jaxtrain.distill.losses`), a JAX teacher's scores (:mod:`jaxtrain.distill.teacher`),
the shared vocabulary of a student and a teacher (:mod:`jaxtrain.distill.vocab`) and xtok's
byte-chunk alignment of two tokenizers (:mod:`jaxtrain.distill.align`); rollouts use
:func:`jaxtrain.models.decode.generate` (ragged prompts, several stop ids). The sources, the
loop and the pgs-distill knobs (still planned) are to come."""
