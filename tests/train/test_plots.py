"""The run plots: every label inside the saved image."""

import struct

from matplotlib.figure import Figure

from openk3.train import plots


def test_attnres_plot_keeps_its_x_label_inside_the_image(tmp_path, monkeypatch):
    seen = {}
    savefig = Figure.savefig

    def spy(fig, path, **kwargs):  # the label and the figure's boxes as drawn, in pixels at dpi 100
        savefig(fig, path, **kwargs)
        renderer = fig.canvas.get_renderer()
        seen.update(label=fig.axes[0].xaxis.label.get_window_extent(renderer), figure=fig.bbox,
                    tight=fig.get_tightbbox(renderer).padded(0.1).transformed(fig.dpi_scale_trans))

    monkeypatch.setattr(Figure, "savefig", spy)
    # two sources per row: the narrowest figure, where the x-label is widest relative to it
    attnres = {"0.mlp": [0.5, 0.5], "1.attn": [0.3, 0.7], "output": [0.2, 0.8]}
    path = plots.plot_attnres(attnres, 7, tmp_path / "attnres.png")
    width, height = struct.unpack(">II", path.read_bytes()[16:24])  # the PNG's IHDR chunk
    figure = seen["figure"]
    # the saved image is the whole figure, or (bbox_inches="tight") the box around everything drawn
    image = figure if (width, height) == (round(figure.width), round(figure.height)) else seen["tight"]
    label = seen["label"]
    assert image.x0 <= label.x0 and label.x1 <= image.x1 and image.y0 <= label.y0, (label, image)
