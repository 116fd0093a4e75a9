"""What a training-curve PNG shows, read back from its pixels (the plot extra's matplotlib decodes it) and from
the text it carries."""

import torch

LOSS_BLUE = torch.tensor([0x1F, 0x77, 0xB4]) / 255  # tab:blue, the loss
TAU_ORANGE = torch.tensor([0xFF, 0x7F, 0x0E]) / 255  # tab:orange, the simulated tau


def curve_pixels(png):
    """(loss, tau) boolean masks of the pixels drawn in each curve's colour (its faint points blend with the
    background, so only the bold line, or the markers of a short run, are counted)."""
    from matplotlib import image

    pixels = torch.from_numpy(image.imread(png)[..., :3].copy())
    assert pixels.shape == (540, 960, 3), pixels.shape  # 8 x 4.5 inches at 120 dpi
    near = lambda color: (pixels - color).abs().amax(-1) < 0.02  # noqa: E731
    return near(LOSS_BLUE), near(TAU_ORANGE)


def height_trend(mask):
    """Mean pixel row of a curve in the left and in the right third of the image (a smaller row is higher up)."""
    rows = torch.arange(mask.shape[0], dtype=torch.float32)[:, None].expand_as(mask)
    third = mask.shape[1] // 3
    mean_row = lambda m, r: float(r[m].mean())  # noqa: E731
    return mean_row(mask[:, :third], rows[:, :third]), mean_row(mask[:, -third:], rows[:, -third:])


def shown(png) -> dict[str, str]:
    """The text a training-curve PNG carries (its title, the plotted series, the before and after), read with PIL."""
    from PIL import Image

    with Image.open(png) as image:
        image.load()
        return dict(image.text)
