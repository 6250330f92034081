"""On-policy distillation as pgs distill runs it (issue #22). Built so far: the losses
(:mod:`jaxtrain.distill.losses`) and a JAX teacher's scores (:mod:`jaxtrain.distill.teacher`);
rollouts use :func:`jaxtrain.models.decode.generate` (ragged prompts, several stop ids). The
sources, the loop and the pgs-distill knobs (still planned) are to come."""
