"""Vision models: OCR (``ocr.py``: rapidocr-onnxruntime 1.4.4's pipeline as a ``MediaEngine``).
Imported only when a configured model uses runtime ``ocr`` (it imports cv2, onnxruntime and
rapidocr_onnxruntime)."""
