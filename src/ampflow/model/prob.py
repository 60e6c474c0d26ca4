"""Likelihoods only: negative binomial and zero-inflated negative binomial.

Networks return these distributions; losses call ``log_prob``. Names here
(``NB``, ``ZINB``; the Hi-C decoder's ``HiCZINB``) are the probability-model names
recorded in the data files' ``uns["ampflow"]["prob_model"]`` and read by the profiler.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

EPS = 1e-8


class NB:
    """Negative binomial parameterised by mean ``mu`` and inverse dispersion ``theta``.

    Parameters
    ----------
    mu : (..., G) tensor, > 0
    theta : (G,) or (..., G) tensor, > 0
    """

    def __init__(self, mu: torch.Tensor, theta: torch.Tensor):
        self.mu = mu
        self.theta = theta

    def log_prob(self, x: torch.Tensor) -> torch.Tensor:
        """Elementwise log p(x), same shape as ``x`` (counts, float)."""
        mu, theta = self.mu, self.theta
        log_theta_mu = torch.log(theta + mu + EPS)
        return (
            theta * (torch.log(theta + EPS) - log_theta_mu)
            + x * (torch.log(mu + EPS) - log_theta_mu)
            + torch.lgamma(x + theta)
            - torch.lgamma(theta)
            - torch.lgamma(x + 1)
        )


class ZINB(NB):
    """NB with a point mass at zero of probability sigmoid(``zi_logits``)."""

    def __init__(self, mu: torch.Tensor, theta: torch.Tensor, zi_logits: torch.Tensor):
        super().__init__(mu, theta)
        self.zi_logits = zi_logits

    def log_prob(self, x: torch.Tensor) -> torch.Tensor:
        nb = super().log_prob(x)
        zi = self.zi_logits
        # log(pi + (1-pi) NB(0)) for zeros, log((1-pi) NB(x)) otherwise, in logit space
        log_not_pi = -F.softplus(zi)
        zero = torch.logaddexp(zi, nb) - F.softplus(zi)
        return torch.where(x < 0.5, zero, log_not_pi + nb)


def kl_normal(loc: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """KL(N(loc, std) || N(0, 1)) elementwise."""
    return 0.5 * (loc.square() + std.square() - 1.0) - torch.log(std + EPS)
