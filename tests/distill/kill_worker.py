"""Run ``python -m jaxtrain.train ARGS...`` in this process and SIGKILL it as step N + 1 starts
training (step N's checkpoint is written):

    python tests/distill/kill_worker.py N ARGS...
"""
import os
import pathlib
import signal
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))


def main():
    from jaxtrain import train
    from jaxtrain.distill import run

    step, args = int(sys.argv[1]), sys.argv[2:]
    real = run.Distiller.train_step

    def train_step(self, state, batch):
        if batch.index == step + 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, state, batch)

    run.Distiller.train_step = train_step
    train.main(args)
    sys.exit(3)   # not killed: the test fails


if __name__ == "__main__":
    main()
