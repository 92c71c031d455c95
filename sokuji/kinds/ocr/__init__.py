"""Kind ``ocr``: PP-OCR over images: text lines (det -> crop -> cls -> rec), the crops of
many requests batched by width."""
