"""A small ResNet-18 (width 8): oneDNN convolution backward allocates scratch that fake
tensors cannot see, so its real CPU peak is above the prediction."""
from graphmem.models import resnet


def model():
    return resnet.build(resnet.ResNetConfig(width=8, num_classes=10))


loss = resnet.loss
