"""VAE networks in the two styles of Chainer's examples/vae/net.py.

``VAE.get_loss_func()`` returns a closure over the model (Chainer up to v6), and
``AvgELBOLoss`` is a link that is both the optimizer's target and the ``loss_func``
(Chainer v7). With ``sample=False`` the latent code is the encoder's mean instead of a
random draw, so that runs are deterministic and can be compared.
"""
import chainer
import chainer.functions as F
from chainer.functions.loss.vae import gaussian_kl_divergence
import chainer.links as L


class VAE(chainer.Chain):
    """Variational AutoEncoder"""

    def __init__(self, n_in, n_latent, n_h):
        super(VAE, self).__init__()
        with self.init_scope():
            # encoder
            self.le1 = L.Linear(n_in, n_h)
            self.le2_mu = L.Linear(n_h, n_latent)
            self.le2_ln_var = L.Linear(n_h, n_latent)
            # decoder
            self.ld1 = L.Linear(n_latent, n_h)
            self.ld2 = L.Linear(n_h, n_in)

    def forward(self, x, sigmoid=True):
        """AutoEncoder"""
        return self.decode(self.encode(x)[0], sigmoid)

    def encode(self, x):
        h1 = F.tanh(self.le1(x))
        mu = self.le2_mu(h1)
        ln_var = self.le2_ln_var(h1)  # log(sigma**2)
        return mu, ln_var

    def decode(self, z, sigmoid=True):
        h1 = F.tanh(self.ld1(z))
        h2 = self.ld2(h1)
        if sigmoid:
            return F.sigmoid(h2)
        else:
            return h2

    def get_loss_func(self, beta=1.0, k=1, sample=True):
        """Loss function of the VAE: the ELBO times -1, averaged over the batch.

        Args:
            beta (float): weight of the KL term of the ELBO.
            k (int): number of Monte Carlo samples of the latent code.
            sample (bool): draw the latent code (else use the encoder's mean).
        """
        def lf(x):
            mu, ln_var = self.encode(x)
            batchsize = len(mu.array)
            # reconstruction loss
            rec_loss = 0
            for _ in range(k):
                z = F.gaussian(mu, ln_var) if sample else mu
                rec_loss += F.bernoulli_nll(x, self.decode(z, sigmoid=False)) \
                    / (k * batchsize)
            self.rec_loss = rec_loss
            self.loss = self.rec_loss + \
                beta * gaussian_kl_divergence(mu, ln_var) / batchsize
            chainer.report(
                {'rec_loss': rec_loss, 'loss': self.loss}, observer=self)
            return self.loss
        return lf


class AvgELBOLoss(chainer.Chain):
    """Loss function of the VAE as a link: optimizer target and ``loss_func`` at once."""

    def __init__(self, vae, beta=1.0, sample=True):
        super(AvgELBOLoss, self).__init__()
        self.beta = beta
        self.sample = sample
        with self.init_scope():
            self.vae = vae

    def forward(self, x):
        mu, ln_var = self.vae.encode(x)
        z = F.gaussian(mu, ln_var) if self.sample else mu
        batchsize = len(x)
        reconstr = -F.bernoulli_nll(x, self.vae.decode(z, sigmoid=False)) / batchsize
        kl_penalty = gaussian_kl_divergence(mu, ln_var) / batchsize
        loss = -(reconstr - self.beta * kl_penalty)
        chainer.report({'loss': loss}, self)
        chainer.report({'reconstr': reconstr}, self)
        chainer.report({'kl_penalty': kl_penalty}, self)
        return loss
