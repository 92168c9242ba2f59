"""The trainer. Importing it first silences the third-party warnings that tell a user nothing
(``dlrm/process/quiet.py``): some fire while TorchRec is being imported."""

from dlrm.process.quiet import silence_third_party_noise

silence_third_party_noise()
