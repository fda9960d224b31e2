"""circle_select's hooks: trim the program's fixed-size buffer to the points it found."""

import nereid
from nereid.tensors import NamedTensor


def trim(outputs):
    # outputs: DETECTIONS [64, 2] (selected points first, zero rows after) and NUM_DETECTIONS [1].
    by_name = {t.name: t.data for t in outputs}
    count = int(by_name["NUM_DETECTIONS"][0])
    return [NamedTensor.from_array("OUTPUT__0", by_name["DETECTIONS"][:count])]


nereid.register_model(postprocess=trim)
